"""Training jobs from a configuration: the loop, the layouts it builds, metrics and scoring."""
