"""tierlm: large hybrid MoE inference with every byte in the right memory tier."""
