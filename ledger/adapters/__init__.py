"""Provider adapters on httpx that turn every outcome into an observation."""
