"""Integrations of forkattn with RL trainers. Each submodule imports its trainer library only
when used: :mod:`forkattn.integrations.trl` (TRL's ``GRPOTrainer``)."""
