"""The training harness: the Trainer and its loop, the loop's hooks, one rank's run, checkpoints and run records."""
