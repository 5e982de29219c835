"""The audit API, its query plans, its command line and the dashboard, over a seeded history."""
