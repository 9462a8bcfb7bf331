"""Launch environments: which launch a process belongs to, a launcher's restarts, lost peers told from bugs."""
