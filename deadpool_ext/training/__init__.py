"""The demo: what the pretraining scripts share (offline data, HF GPT-2/BERT builders, the loop; ``megatron/``:
the Megatron-Core demo).

**A tool beside the product, not part of it**: the core and the integrations (Megatron's too) never import this
package (the import contracts in ``pyproject.toml`` forbid it), so a user's own job runs none of it; only the
provided scripts in ``scripts/`` do.
"""
