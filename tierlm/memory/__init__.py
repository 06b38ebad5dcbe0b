"""Memory tiers: capacity planning, the NVMe tier for the PLE tables, and exact-size host pools."""
