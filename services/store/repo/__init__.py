"""The store's data access, one module per group of StoreService RPCs; `Repository` composes them."""
