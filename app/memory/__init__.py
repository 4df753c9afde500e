"""The memory panel: where memory goes, and the first-token latency chart."""
