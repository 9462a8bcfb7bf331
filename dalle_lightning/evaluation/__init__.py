"""Evaluation and plots: caption accuracy, FID and contrastive score against best-of-N (``evaluate``,
``dalle-eval``), the waterfall of where captions are lost, stage by stage (``waterfall``, ``plot_waterfall``), image
grids (``grid``), the report's figures (``plot``) and accuracy against training time
(``python -m dalle_lightning.evaluation.plot_quality_vs_time``)."""
