"""Pipeline schedules as pure data: the IR, the registry, generators, validation, comm, simulation, timelines."""
