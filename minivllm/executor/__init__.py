"""Executors: turn a StepPlan into sampled tokens (fake numpy model or real torch model)."""
