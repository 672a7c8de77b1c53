"""pipecut's runtime: schedules, simulation, and the executor that trains a plan as a pipeline."""
