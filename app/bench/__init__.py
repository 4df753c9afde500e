"""The benchmark tab: runs `strata bench` in a child process and compares results."""
