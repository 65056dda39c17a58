//! The caller's memory: destinations registered for one call or found in
//! the registration cache, fencing, and the cache itself.

use super::*;

impl Engine {
    /// Where a read of `len` bytes at `ptr` lands in caller memory: the
    /// cached registration when the range lies in a
    /// [`crate::RegisteredBuf`], otherwise (if `per_call`) a
    /// registration made now for this call, dropped with the returned value;
    /// `None` when neither applies. Each call gets a new group for
    /// [`Engine::fence_group`].
    ///
    /// # Safety
    /// `ptr..ptr + len` must be memory the caller holds exclusively, with no
    /// Rust reference over it while the read runs: a raw pointer (C
    /// memory, or a [`crate::RegisteredBuf`]'s own pointer under its
    /// `&mut`), since a cached registration's writes do not go through a
    /// pointer derived from any reference the caller holds. It must stay
    /// allocated until `fence_group(dst.group)` has returned and the
    /// returned value is dropped. Use [`Engine::slice_dst`] for a `&mut
    /// [u8]`.
    pub unsafe fn user_dst(
        &self,
        ptr: *mut u8,
        len: usize,
        per_call: bool,
    ) -> Result<Option<UserDst>> {
        // SAFETY: the caller's contract, which is this one's with the cache.
        unsafe { self.caller_dst(ptr, len, per_call, true) }
    }

    /// As [`Engine::user_dst`] for memory behind a `&mut [u8]` that the
    /// caller holds (and does not use) while the read runs: never the
    /// registration cache, only (with `per_call`) a registration of `ptr`
    /// made now, so every write the peer makes goes through a pointer
    /// derived from the caller's reference, which the aliasing model allows
    /// while that reference is not used. `None` otherwise (the caller
    /// stages), also for a slice of a [`crate::RegisteredBuf`].
    ///
    /// # Safety
    /// `ptr` must be derived from a `&mut [u8]` of `len` bytes that the
    /// caller holds exclusively and does not use until
    /// `fence_group(dst.group)` has returned and the returned value is
    /// dropped.
    pub unsafe fn slice_dst(
        &self,
        ptr: *mut u8,
        len: usize,
        per_call: bool,
    ) -> Result<Option<UserDst>> {
        // SAFETY: the caller's contract; without the cache the only
        // registration is of `ptr` itself, which the caller's reference
        // keeps allocated until the group is fenced.
        unsafe { self.caller_dst(ptr, len, per_call, false) }
    }

    /// [`Engine::user_dst`] (`cached`) or [`Engine::slice_dst`].
    ///
    /// # Safety
    /// That of the public function called.
    pub(super) unsafe fn caller_dst(
        &self,
        ptr: *mut u8,
        len: usize,
        per_call: bool,
        cached: bool,
    ) -> Result<Option<UserDst>> {
        // Caller memory, like the engine's: no remote right of its own, only
        // the windows bound per read.
        let access = Access::LOCAL_WRITE | Access::MW_BIND;
        let mut state = lock(&self.state);
        let group = state.next_group;
        state.next_group += 1;
        let hit = if cached {
            state.cache.find(ptr as usize, len).map(|(k, _)| k)
        } else {
            None
        };
        if let Some(start) = hit {
            state.cache.tick += 1;
            let tick = state.cache.tick;
            let EngineState { cache, stats, .. } = &mut *state;
            let need = cache
                .entries
                .get(&start)
                .map_or(0, |e| if e.reg.is_none() { e.len } else { 0 });
            if need > 0 {
                cache.make_room(need, stats);
            }
            let Some(e) = cache.entries.get_mut(&start) else {
                return Err(Error::Io("registration cache entry vanished".into()));
            };
            e.last_use = tick;
            let reg = match &e.reg {
                Some(r) => {
                    stats.reg_cache_hits += 1;
                    r.clone()
                }
                None => {
                    // SAFETY: the memory is the entry's `RegBuf`, and the
                    // registration keeps an `Arc` of it (`UserReg::_mem`),
                    // so it stays allocated for as long as the region exists.
                    // The region's own keys are never sent; the peer reaches
                    // it only through one-shot windows bound by a read into
                    // the buffer, which the read fences before it returns,
                    // and such a read comes only through `user_dst`, whose
                    // contract excludes any Rust reference over the range
                    // meanwhile (a `&mut` slice of the buffer takes
                    // `slice_dst`, which never uses this registration).
                    let mr = unsafe { self.pd.register_raw(e.mem.as_ptr(), e.len, access)? };
                    let r = Arc::new(UserReg {
                        mr,
                        _mem: Some(e.mem.clone()),
                    });
                    e.reg = Some(r.clone());
                    cache.reg_entries += 1;
                    cache.reg_bytes += e.len;
                    stats.reg_cache_misses += 1;
                    r
                }
            };
            return Ok(Some(UserDst {
                reg,
                off: ptr as usize - start,
                group,
            }));
        }
        if !per_call {
            return Ok(None);
        }
        // SAFETY: the caller's contract (exclusively held, allocated until
        // the group is fenced and this registration dropped).
        let mr = unsafe { self.pd.register_raw(ptr, len, access)? };
        state.stats.call_registrations += 1;
        Ok(Some(UserDst {
            reg: Arc::new(UserReg { mr, _mem: None }),
            off: 0,
            group,
        }))
    }

    /// Return once no remote write can reach the caller memory of `group`
    /// any more: every window of the group was invalidated and the
    /// invalidation completed. If a request of the group is still
    /// outstanding (its waiter gave up), or the invalidations do not
    /// complete in time, the queue pair is moved to the error state (no
    /// further remote access is executed) and the connection is lost.
    pub fn fence_group(&self, group: u64) {
        let _waiting = Waiting::new(self);
        let deadline = Instant::now() + self.cfg.op_timeout;
        let mut state = lock(&self.state);
        let kill = |state: &mut EngineState, why: &str| {
            self.qp.set_error();
            state.inval_pending.remove(&group);
            if !why.is_empty() {
                self.mark_lost(state, why.into());
            }
        };
        if state.conn.outstanding_users().any(|r| r.group == group) {
            kill(
                &mut state,
                "a read into caller memory did not complete; the connection is closed so that \
                 no late write can reach the buffer",
            );
            return;
        }
        loop {
            if !state.inval_pending.contains_key(&group) {
                return;
            }
            if state.lost.is_some() || self.qp.state() == QpState::Error {
                kill(&mut state, "");
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                kill(&mut state, "invalidating caller-memory windows timed out");
                return;
            }
            self.sleep_or_drive(state, (deadline - now).min(Duration::from_millis(50)));
            state = lock(&self.state);
        }
    }

    /// Add an explicitly registered buffer to the registration cache and
    /// register it. Returns its start address (the cache key).
    pub(crate) fn cache_insert(&self, mem: Arc<RegBuf>) -> Result<usize> {
        let start = mem.as_ptr() as usize;
        let len = mem.len();
        if len > self.cfg.reg_cache_bytes {
            return Err(Error::InvalidArgument(format!(
                "a registered buffer of {len} bytes exceeds the registration cache ({} bytes)",
                self.cfg.reg_cache_bytes
            )));
        }
        let mut state = lock(&self.state);
        state.cache.entries.insert(
            start,
            CacheEntry {
                mem,
                len,
                reg: None,
                last_use: 0,
            },
        );
        drop(state);
        // Register now (so the first read does not pay for it).
        // SAFETY: no read runs here: with `per_call` false and the entry just
        // inserted this takes the cached path, which only registers the
        // entry's own `RegBuf` (kept alive by the entry and the
        // registration's `Arc`) and binds no window; the returned `UserDst`
        // is a fresh group with nothing to fence and is dropped at once. No
        // Rust reference to the buffer exists yet: the `RegisteredBuf` that
        // hands them out is created only after we return.
        let first = unsafe { self.user_dst(start as *mut u8, len, false) };
        match first {
            Ok(_) => Ok(start),
            Err(e) => {
                lock(&self.state).cache.entries.remove(&start);
                Err(e)
            }
        }
    }

    /// Explicit release of a registered buffer: its registration is
    /// deregistered and the entry forgotten.
    pub(crate) fn cache_release(&self, start: usize) {
        let mut state = lock(&self.state);
        if let Some(e) = state.cache.entries.remove(&start) {
            if e.reg.is_some() {
                state.cache.reg_entries -= 1;
                state.cache.reg_bytes -= e.len;
            }
        }
    }
}
