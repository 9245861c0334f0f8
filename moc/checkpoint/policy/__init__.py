"""What a checkpoint saves: the PEC policy and its expert selection (selection), and the
routed-token ledger that owns PLT and Dynamic-K (tokens)."""
