"""The retry owner (execute/aexecute): budgets, cancellation, the presets over time."""
