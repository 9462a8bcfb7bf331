"""Reusable Lightning callbacks (schedules, image grids, FID). Never imports ``dalle_lightning``."""
