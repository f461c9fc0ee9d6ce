"""OS and network plumbing shared by every layer (ports, paths, child processes); imports
nothing else of this package."""
