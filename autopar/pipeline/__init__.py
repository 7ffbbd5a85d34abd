"""Pipeline parallelism: schedules, their simulated timelines, and stage partitioning."""
