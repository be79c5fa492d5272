"""Diffusers pipelines for denoisers diffusers has no pipeline for (MicroDiT)."""
