//! NTSTATUS values used by LWIO (docs/protocol.md §4.4).

pub type NtStatus = u32;

pub const STATUS_SUCCESS: NtStatus = 0x0000_0000;
/// Delta-credit / credit-retire status (the seed's LWIO_NOTIFY_CREDIT).
pub const LWIO_NOTIFY_CREDIT: NtStatus = 0x0000_0001;
/// Polled status block "not yet written" sentinel; never a completion.
pub const STATUS_PENDING: NtStatus = 0x0000_0103;
pub const STATUS_INVALID_HANDLE: NtStatus = 0xC000_0008;
pub const STATUS_INVALID_PARAMETER: NtStatus = 0xC000_000D;
pub const STATUS_INVALID_DEVICE_REQUEST: NtStatus = 0xC000_0010;
pub const STATUS_END_OF_FILE: NtStatus = 0xC000_0011;
pub const STATUS_ACCESS_DENIED: NtStatus = 0xC000_0022;
pub const STATUS_DISK_FULL: NtStatus = 0xC000_007F;
pub const STATUS_INSUFFICIENT_RESOURCES: NtStatus = 0xC000_009A;
pub const STATUS_IO_TIMEOUT: NtStatus = 0xC000_00B5;
pub const STATUS_NOT_SUPPORTED: NtStatus = 0xC000_00BB;
pub const STATUS_CANCELLED: NtStatus = 0xC000_0120;
pub const STATUS_FILE_CLOSED: NtStatus = 0xC000_0128;
/// The file is gone while open: a memory object whose publisher withdrew it
/// (docs/memory-objects.md). Clients map it to ESTALE.
pub const STATUS_FILE_DELETED: NtStatus = 0xC000_0123;
/// A buffer size outside what was negotiated (e.g. a fragmented message
/// over the maximum).
pub const STATUS_INVALID_BUFFER_SIZE: NtStatus = 0xC000_0206;

/// True for error statuses (severity bits 11).
pub fn is_error(s: NtStatus) -> bool {
    s >> 30 == 3
}

/// Human-readable name, if known.
pub fn name(s: NtStatus) -> Option<&'static str> {
    Some(match s {
        STATUS_SUCCESS => "STATUS_SUCCESS",
        LWIO_NOTIFY_CREDIT => "LWIO_NOTIFY_CREDIT",
        STATUS_PENDING => "STATUS_PENDING",
        STATUS_INVALID_HANDLE => "STATUS_INVALID_HANDLE",
        STATUS_INVALID_PARAMETER => "STATUS_INVALID_PARAMETER",
        STATUS_INVALID_DEVICE_REQUEST => "STATUS_INVALID_DEVICE_REQUEST",
        STATUS_END_OF_FILE => "STATUS_END_OF_FILE",
        STATUS_ACCESS_DENIED => "STATUS_ACCESS_DENIED",
        STATUS_DISK_FULL => "STATUS_DISK_FULL",
        STATUS_INSUFFICIENT_RESOURCES => "STATUS_INSUFFICIENT_RESOURCES",
        STATUS_IO_TIMEOUT => "STATUS_IO_TIMEOUT",
        STATUS_NOT_SUPPORTED => "STATUS_NOT_SUPPORTED",
        STATUS_CANCELLED => "STATUS_CANCELLED",
        STATUS_FILE_CLOSED => "STATUS_FILE_CLOSED",
        STATUS_FILE_DELETED => "STATUS_FILE_DELETED",
        STATUS_INVALID_BUFFER_SIZE => "STATUS_INVALID_BUFFER_SIZE",
        _ => return None,
    })
}
