"""The cancel of one task, apart from where it comes from: the run it stops (`Work`), the
cancel itself (`Cancellation`), the queues the run and the cancel see, the time each step may
take (`Timing`), and CANCELED written straight to the store (`CanceledWrites`)."""
