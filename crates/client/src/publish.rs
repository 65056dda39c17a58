//! Memory objects reachable by path (docs/memory-objects.md, seed 004).
//!
//! [`Client::publish`] hands a [`RegisteredBuf`] to the server as
//! `EXPORT/.lwio-mem/NAME`: other clients open that path and read (and, with
//! a read-write grant, write) the buffer with ordinary file I/O, which the
//! server carries out with RDMA Reads and Writes on this client's channel 0.
//!
//! The buffer is registered for remote access on its own, exactly over the
//! published range, with remote read (and remote write only for
//! [`MemRights::ReadWrite`]); its key goes to the server over the
//! authenticated side-channel session and nowhere else, and the server uses
//! it only on this client's own RDMA connection. Unpublishing (or dropping
//! the [`Published`], or this client going away) withdraws the path and
//! deregisters the range, which invalidates the key.
//!
//! While published, the bytes may change under the client at any time (a
//! remote writer), so [`Published`] offers copying accessors only and never
//! a Rust reference to them; [`Published::unpublish`] gives the buffer back
//! once no key reaches it any more.

use lwio_rdma::{Access, Mr};
use lwio_side::codec::{MEM_READ, MEM_WRITE};

use crate::{Client, Error, RegisteredBuf, Result};

/// What other clients may do with a published object (within their own
/// rights on the export).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemRights {
    ReadOnly,
    ReadWrite,
}

/// A published memory object. Dropping it unpublishes (best effort).
pub struct Published {
    client: Client,
    export: String,
    name: String,
    path: String,
    /// The remote-access registration of exactly the published range;
    /// `None` once withdrawn.
    mr: Option<Mr>,
    /// The memory (its allocation outlives `mr`).
    buf: Option<RegisteredBuf>,
    rights: MemRights,
}

impl std::fmt::Debug for Published {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Published")
            .field("path", &self.path)
            .field("len", &self.len())
            .field("rights", &self.rights)
            .finish()
    }
}

/// A refused [`Client::publish`]: why, and the buffer, given back untouched
/// (unregistered for remote access again: no key to it is valid).
pub struct PublishError {
    pub error: Error,
    pub buf: RegisteredBuf,
}

impl PublishError {
    /// The buffer, the caller's again.
    pub fn into_buf(self) -> RegisteredBuf {
        self.buf
    }
}

impl std::fmt::Debug for PublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishError")
            .field("error", &self.error)
            .field("buf", &self.buf)
            .finish()
    }
}

impl std::fmt::Display for PublishError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for PublishError {}

impl From<PublishError> for Error {
    fn from(e: PublishError) -> Error {
        e.error
    }
}

impl Client {
    /// Publish `buf` as memory object `name`: `NAME` in the export of the
    /// URL this client connected to, or `EXPORT/NAME`. The object's path
    /// is `EXPORT/.lwio-mem/NAME` ([`Published::path`]); it lives until
    /// [`Published::unpublish`], the drop of the [`Published`], or this
    /// client's disconnection. Needs write access to the export.
    ///
    /// On any error the buffer comes back in the [`PublishError`], its
    /// remote-access registration already withdrawn: a caller that lent
    /// its memory (the C API's `lwio_publish`) keeps it.
    pub fn publish(
        &self,
        name: &str,
        buf: RegisteredBuf,
        rights: MemRights,
    ) -> std::result::Result<Published, PublishError> {
        let (export, name) = match self.split(name) {
            Ok(v) => v,
            Err(error) => return Err(PublishError { error, buf }),
        };
        if name.is_empty() || name.contains('/') {
            return Err(PublishError {
                error: Error::InvalidArgument(format!(
                    "{name:?}: a memory object's name is one path component"
                )),
                buf,
            });
        }
        let len = buf.len;
        let access = match rights {
            MemRights::ReadOnly => Access::REMOTE_READ,
            MemRights::ReadWrite => {
                Access::REMOTE_READ | Access::REMOTE_WRITE | Access::LOCAL_WRITE
            }
        };
        let engine = self.0.channel(0).clone();
        // SAFETY: `buf.mem` is a live allocation of at least `len` bytes
        // (page-rounded); `Published` owns `buf` until after the Mr is
        // dropped (`withdraw` drops the Mr first, and `unpublish` hands
        // `buf` back only then), so the range stays allocated while the key
        // is valid; on an error below the Mr is dropped before `buf` is
        // handed back. The registration covers exactly [ptr, ptr+len), the
        // published range. No Rust reference to those bytes exists while it
        // lives: `buf` is moved in here (its Deref is unreachable until it
        // is given back), and `Published` reads and writes them only
        // through the Mr's copying accessors.
        let mr = match unsafe { engine.pd().register_raw(buf.mem.as_ptr(), len, access) } {
            Ok(mr) => mr,
            Err(e) => {
                return Err(PublishError {
                    error: e.into(),
                    buf,
                })
            }
        };
        let key = self
            .0
            .channel_keys
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .first()
            .copied()
            .ok_or_else(|| Error::Side("no RDMA channel".into()));
        let bits = match rights {
            MemRights::ReadOnly => MEM_READ,
            MemRights::ReadWrite => MEM_READ | MEM_WRITE,
        };
        let rel = key.and_then(|key| {
            self.0.side(|s| {
                s.publish(
                    &export,
                    &name,
                    len as u64,
                    mr.addr(),
                    mr.rkey(),
                    bits,
                    key.to_bytes(),
                )
            })
        });
        let rel = match rel {
            Ok(rel) => rel,
            Err(error) => {
                // The key dies before the memory is the caller's again
                // (a server that published it after all, e.g. past a
                // timeout, can no longer reach it).
                drop(mr);
                return Err(PublishError { error, buf });
            }
        };
        Ok(Published {
            client: self.clone(),
            path: format!("{export}/{rel}"),
            export,
            name,
            mr: Some(mr),
            buf: Some(buf),
            rights,
        })
    }
}

impl Published {
    /// The object's path: `EXPORT/.lwio-mem/NAME` (open it with
    /// [`Client::open`], or `lwio://HOST/EXPORT/.lwio-mem/NAME`).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The object's size.
    pub fn len(&self) -> usize {
        self.mr.as_ref().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn rights(&self) -> MemRights {
        self.rights
    }

    fn mr(&self) -> Result<&Mr> {
        self.mr
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument("memory object withdrawn".into()))
    }

    /// Copy `dst.len()` bytes at `offset` of the object out (a snapshot:
    /// a remote writer may change them meanwhile).
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        Ok(self.mr()?.read_at(offset, dst)?)
    }

    /// Copy `src` into the object at `offset`.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> Result<()> {
        Ok(self.mr()?.write_at(offset, src)?)
    }

    /// The write notification: wait until more than `seen` writes by
    /// other clients into the object have completed (or `timeout`, at most
    /// 60 s, passes) and return how many have. Start with 0 and pass the
    /// last count back. Holds this client's side channel while it waits.
    ///
    /// The writes counted are in this client's memory when it returns: the
    /// server answers a write once its RDMA Write is sent, so this waits
    /// for an ordering barrier on channel 0 ([`crate::Engine::barrier`])
    /// after the count.
    pub fn wait_writes(&self, seen: u64, timeout: std::time::Duration) -> Result<u64> {
        let ms = u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX);
        let n = self
            .client
            .0
            .side(|s| s.wait_writes(&self.export, &self.name, seen, ms))?;
        if n > seen {
            self.client.0.channel(0).barrier()?;
        }
        Ok(n)
    }

    /// The whole object, copied out.
    pub fn to_vec(&self) -> Result<Vec<u8>> {
        let mut v = vec![0u8; self.len()];
        self.read_at(0, &mut v)?;
        Ok(v)
    }

    /// Withdraw the object and take the buffer back: no key reaches the
    /// memory any more (the registration is gone), and the path is gone
    /// (the server withdraws it by itself when it could not be told: the
    /// session or channel ended). The buffer comes back even then; only a
    /// refusal by the server that leaves the object listed is an error, and
    /// the key is dead even so.
    pub fn unpublish(mut self) -> Result<RegisteredBuf> {
        let r = self.withdraw();
        let buf = self
            .buf
            .take()
            .ok_or_else(|| Error::InvalidArgument("memory object withdrawn".into()))?;
        if let Err(e) = r {
            tracing::warn!(path = %self.path, error = %e, "unpublish: the server was not told; the key is invalidated");
        }
        Ok(buf)
    }

    /// Unpublish on the server, wait until the writes it made are placed,
    /// then deregister (invalidating the key) even when the server cannot
    /// be told (it withdraws the object itself when this client's session
    /// or channel ends).
    fn withdraw(&mut self) -> Result<()> {
        let Some(mr) = self.mr.take() else {
            return Ok(());
        };
        let r = self
            .client
            .0
            .side(|s| s.unpublish(&self.export, &self.name));
        if r.is_ok() {
            // The server answered once its RDMA operations on the object
            // completed; a Write's completion means only that it was sent.
            // The barrier's answer comes after them on the connection:
            // once it is in, so are their bytes, and deregistering cannot
            // strand one (a write the writer was told is done, missing
            // from the buffer given back). Best effort: a lost connection
            // has nothing more to place.
            if let Err(e) = self.client.0.channel(0).barrier() {
                tracing::debug!(path = %self.path, error = %e, "unpublish: no ordering barrier");
            }
        }
        drop(mr);
        match r {
            Ok(()) => Ok(()),
            // Gone already (the server withdrew it): nothing to undo.
            Err(Error::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        let _ = self.withdraw();
    }
}
