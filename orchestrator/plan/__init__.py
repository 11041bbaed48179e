"""What a run costs before it trains: targets, the step compiled for them, the check before a launch."""
