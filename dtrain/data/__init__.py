"""Training data, numpy and torch only: sources (synthetic, scikit-learn, .npz/.csv/.parquet files)
split into train and test, and each replica's deterministic order of batches; recommendation
records (Criteo-layout .tsv files, parquet) packed into fixed-width int64 rows (``features``)."""
