"""The process runtime: MPI start-up, placement, devices and seeding; the hang watchdog; injected load imbalance."""
