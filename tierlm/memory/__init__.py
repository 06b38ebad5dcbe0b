"""Memory tiers: capacity planning now; host pools, the n-gram store and the row cache later."""
