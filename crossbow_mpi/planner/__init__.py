"""The planner's performance model (pure functions) and the measurements it needs."""
