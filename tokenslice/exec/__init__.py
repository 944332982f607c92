"""Executors run StepPlans: the real model locally, distributed workers, or a simulator."""
