"""Driver-side planning, pure and without Ray: the job, the tensor layout, work units and
parts, parameters, sizing and devices, and what `plan` reports of them (`plan_report`). The
engine runs what this decides."""
