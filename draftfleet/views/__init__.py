"""The operator's views: what status, inventory, pivot, metrics and Flower show, read from the core state
(store, ledger, queues, claims). Nothing in the core imports them."""
