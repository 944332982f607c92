"""Scheduling: policies order requests, the Scheduler turns an order into a StepPlan. No torch."""
