"""Process machinery: worker processes, the fail-closed supervisor, and what a cut-short run leaves
behind (temporary files, child processes)."""
