"""The Megatron-Core demo: the GPT model, its step and the pretraining loop of ``scripts/pretrain_gpt_megatron.py``
(a tool beside the product: the integration itself is ``deadpool_ext/integrations/megatron/``)."""
