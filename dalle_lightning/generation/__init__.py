"""Generation: from a caption to ranked images. The prior's sampling (``sampling``) with optional priming on an
image's first rows (``priming``), the candidates' scores (``rerank``: the contrastive model, ``prior_score``: the
prior's own log p(image | caption) - log p(image | null caption)), which one to keep (``selection``), and
``generate.Generator``, which ties them to the trained files (``dalle-generate``)."""
