"""Driver-side planning, pure and without Ray: the job, the tensor layout, work units and
parts, parameters, sizing and devices. The engine runs what this decides."""
