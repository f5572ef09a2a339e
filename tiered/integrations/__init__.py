"""Bridges to other libraries' training stacks; each imports its library only when used.

``tiered.integrations.transformers``: ``TieredTrainer`` (Hugging Face ``Trainer`` over a tiered
engine), its mixin for ``trl``'s trainers, and ``load_model`` (a checkpoint folder read straight
into the tiers). Install with ``pip install 'tiered[hf]'``.
"""
