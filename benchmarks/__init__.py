"""Benchmarks of crossbow_mpi: one entry point per question (`python -m benchmarks.NAME [--quick]`)."""
