"""Process groups and worlds (trainer/generator ranks), determinism, DTensor helpers."""
