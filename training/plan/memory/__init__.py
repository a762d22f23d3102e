"""Memory: the planner's model of every strategy, and the ledger of what a rank really holds."""
