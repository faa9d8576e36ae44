"""Plugins that give other training frameworks every ampkit mode (import the one you use: it needs that package).

* ``ampkit.integrations.accelerate``: ``backward``, ``step`` (and ``setup``) for a plain accelerate loop;
* ``ampkit.integrations.fastai``: ``AmpkitCallback``; ``ampkit.integrations.ignite``: ``create_supervised_trainer``;
* ``ampkit.integrations.hf``: ``AmpkitTrainer``, the Hugging Face ``Trainer`` (transformers, accelerate);
* ``ampkit.integrations.lightning``: ``AmpkitPrecision`` (Trainer) and ``AmpkitFabricPrecision`` (Fabric);
* ``ampkit.integrations.timm``: ``AmpkitScaler``, timm's ``NativeScaler`` protocol (timm itself not needed).

docs/INTEGRATIONS.md says what each changes and what lands in the framework's own checkpoints.
"""
