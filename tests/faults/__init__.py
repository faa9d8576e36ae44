"""Fault injection: kill -9, full/read-only disks, hostile checkpoints, NaN storms, bad inputs."""
