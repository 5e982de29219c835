"""The httpx adapters over real loopback HTTP: codecs, transport mapping, streams, secrets."""
