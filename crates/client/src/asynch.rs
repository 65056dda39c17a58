//! The async (tokio) client API.
//!
//! Each operation runs the blocking engine on tokio's blocking pool. Data is
//! read into a buffer the operation owns and copied into the caller's
//! buffer only when the future completes, so **dropping a future never lets
//! the server write into memory the caller got back**: the engine keeps its
//! registered staging memory until the request completes, and the dropped
//! future's drop guard issues a CANCEL naming each request of that future
//! still outstanding (docs/protocol.md §5.9): those complete with
//! STATUS_CANCELLED if the server can still stop them, and the other I/O of
//! the file — other futures, other threads — is left alone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use lwio_proto::client::ReqId;

use super::{Client, ClientOptions, ClientStats, Error, File, OpenOptions, Result};

fn joined<T>(r: std::result::Result<Result<T>, tokio::task::JoinError>) -> Result<T> {
    r.unwrap_or_else(|e| Err(Error::Io(format!("client task failed: {e}"))))
}

/// Async client.
#[derive(Clone, Debug)]
pub struct AsyncClient(Client);

impl AsyncClient {
    pub async fn connect(
        target: &str,
        token: Option<&str>,
        opts: ClientOptions,
    ) -> Result<AsyncClient> {
        let (t, k) = (target.to_string(), token.map(str::to_string));
        let c = tokio::task::spawn_blocking(move || Client::connect(&t, k.as_deref(), opts)).await;
        joined(c).map(AsyncClient)
    }

    pub async fn open(&self, path: &str, o: &OpenOptions) -> Result<AsyncFile> {
        let (c, p, o) = (self.0.clone(), path.to_string(), *o);
        let f = joined(tokio::task::spawn_blocking(move || c.open(&p, &o)).await)?;
        Ok(AsyncFile {
            file: Arc::new(f),
            cancels: Arc::new(AtomicU64::new(0)),
        })
    }

    pub async fn interrupt(&self) -> Result<()> {
        let c = self.0.clone();
        joined(tokio::task::spawn_blocking(move || c.interrupt()).await)
    }

    pub fn stats(&self) -> ClientStats {
        self.0.stats()
    }

    /// The blocking client underneath.
    pub fn blocking(&self) -> &Client {
        &self.0
    }
}

/// Async file handle (cheap to clone).
#[derive(Clone, Debug)]
pub struct AsyncFile {
    file: Arc<File>,
    cancels: Arc<AtomicU64>,
}

/// The requests one call (one future) has outstanding.
#[derive(Debug, Default)]
pub(crate) struct CallRequests(Mutex<CallState>);

#[derive(Debug, Default)]
struct CallState {
    cancelled: bool,
    reqs: Vec<ReqId>,
}

impl CallRequests {
    fn state(&self) -> std::sync::MutexGuard<'_, CallState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
    /// Record an issued request; false if the call is cancelled (the
    /// canceller did not see it: the caller cancels it).
    pub(crate) fn add(&self, req: ReqId) -> bool {
        let mut st = self.state();
        if !st.cancelled {
            st.reqs.push(req);
        }
        !st.cancelled
    }
    /// `req` completed.
    pub(crate) fn done(&self, req: ReqId) {
        self.state().reqs.retain(|&r| r != req);
    }
    pub(crate) fn is_cancelled(&self) -> bool {
        self.state().cancelled
    }
    /// Mark cancelled (no more requests are issued); the outstanding ones.
    pub(crate) fn cancel(&self) -> Vec<ReqId> {
        let mut st = self.state();
        st.cancelled = true;
        std::mem::take(&mut st.reqs)
    }
}

/// Cancels the future's own requests if it is dropped before it finished.
struct CancelOnDrop {
    file: Option<Arc<File>>,
    call: Arc<CallRequests>,
    cancels: Arc<AtomicU64>,
}

impl CancelOnDrop {
    fn disarm(&mut self) {
        self.file = None;
    }
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(f) = self.file.take() {
            self.cancels.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(fid = f.fid(), "future dropped: cancelling its requests");
            let call = self.call.clone();
            let cancel = move || {
                let _ = f.cancel_call(&call);
            };
            match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    h.spawn_blocking(cancel);
                }
                Err(_) => {
                    std::thread::spawn(cancel);
                }
            }
        }
    }
}

impl AsyncFile {
    fn guard(&self) -> CancelOnDrop {
        CancelOnDrop {
            file: Some(self.file.clone()),
            call: Arc::new(CallRequests::default()),
            cancels: self.cancels.clone(),
        }
    }

    /// CANCELs issued because futures were dropped.
    pub fn dropped_futures(&self) -> u64 {
        self.cancels.load(Ordering::Relaxed)
    }

    pub fn fid(&self) -> u16 {
        self.file.fid()
    }

    /// Read into `buf` at `offset`.
    pub async fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let mut g = self.guard();
        let (f, len, call) = (self.file.clone(), buf.len(), g.call.clone());
        let r = tokio::task::spawn_blocking(move || {
            let mut v = vec![0u8; len];
            let n = f.read_at_in(&mut v, offset, &call)?;
            v.truncate(n);
            Ok(v)
        })
        .await;
        g.disarm();
        let v = joined(r)?;
        buf[..v.len()].copy_from_slice(&v);
        Ok(v.len())
    }

    pub async fn write_at(&self, data: &[u8], offset: u64) -> Result<usize> {
        let mut g = self.guard();
        let (f, d, call) = (self.file.clone(), data.to_vec(), g.call.clone());
        let r = tokio::task::spawn_blocking(move || f.write_at_in(&d, offset, &call)).await;
        g.disarm();
        joined(r)
    }

    pub async fn cancel(&self) -> Result<()> {
        let f = self.file.clone();
        joined(tokio::task::spawn_blocking(move || f.cancel()).await)
    }

    pub async fn len(&self) -> Result<u64> {
        let f = self.file.clone();
        joined(tokio::task::spawn_blocking(move || f.len()).await)
    }

    pub async fn set_len(&self, size: u64) -> Result<()> {
        let f = self.file.clone();
        joined(tokio::task::spawn_blocking(move || f.set_len(size)).await)
    }

    /// Close (when this is the last handle; otherwise the last drop closes).
    pub async fn close(self) -> Result<()> {
        match Arc::try_unwrap(self.file) {
            Ok(f) => joined(tokio::task::spawn_blocking(move || f.close()).await),
            Err(_) => Ok(()),
        }
    }
}
