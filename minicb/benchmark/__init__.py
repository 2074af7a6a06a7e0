"""Measuring the engine (chapters 05 and 06): workloads, metrics, the simulated executor, and the
`bench`, `sweep` and `profile` commands. Depends on the core; the core never imports it."""
