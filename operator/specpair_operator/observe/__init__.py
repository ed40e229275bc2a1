"""Every read a reconcile pass needs, turned into values (ReleaseWorld, ServingWorld): the input of
the plans. Observe decides nothing and writes nothing."""
