"""Controllers that tune a run as it trains: learners per rank, adaptive batch sizes, Omnivore's search, the
learning-rate schedule."""
