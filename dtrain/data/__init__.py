"""Training data, numpy and torch only: sources (synthetic, scikit-learn, .npz/.csv/.parquet files)
split into train and test, and each replica's deterministic order of batches."""
