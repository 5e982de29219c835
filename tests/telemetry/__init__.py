"""OpenTelemetry spans and metrics of turns and attempts."""
