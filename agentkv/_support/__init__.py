"""agentkv's internal support: process-wide defaults, the environment read in one place, lazy exports, the build
of a wheel's extras. Nothing here is public."""
