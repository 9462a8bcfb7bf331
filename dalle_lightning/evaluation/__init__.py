"""Evaluation and plots: on the shapes world, caption accuracy against best-of-N (``evaluate``) and the waterfall of
where captions are lost, stage by stage (``waterfall``, ``plot_waterfall``); on any captioned data, the val split's
captions and images (``val_captions``, ``captioned_data``); on both, FID, KID and contrastive score in every feature
space (``feature_spaces``, ``feature_distances``, ``best_of_n``) beside what real images score (``dalle-eval``);
image grids (``grid``), the report's figures (``plot``) and accuracy against training time
(``python -m dalle_lightning.evaluation.plot_quality_vs_time``)."""
