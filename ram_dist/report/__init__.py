"""Presentation: what a person reads of a job's report. `text` (the command's tables),
`figures` (the probe's figures, layer table and Markdown summary) and `model_card` (the
output's README.md). Reads report dicts only; imports nothing of the engine."""
