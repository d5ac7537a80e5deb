//! Passing the DRAM arena's file descriptor to a local client (SCM_RIGHTS).

use std::os::fd::RawFd;

/// Sends `bytes` on the Unix stream socket `sock` with `fd` attached. Non-blocking: returns
/// `WouldBlock` when the socket is full. Returns the bytes sent (the fd rides with them).
pub(crate) fn send_fd(sock: RawFd, bytes: &[u8], fd: RawFd) -> std::io::Result<usize> {
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
    let mut control = vec![0u8; space];
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data; zeroed is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space as _;
    // SAFETY: msg_control points at `space` bytes, enough for one cmsg holding one fd, so
    // CMSG_FIRSTHDR is non-null and CMSG_DATA has room for the fd. `iov` borrows `bytes`,
    // which the kernel only reads. Both outlive the sendmsg call.
    let n = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg) as *mut RawFd, fd);
        libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL)
    };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(n as usize)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Seek, Write};
    use std::os::fd::{AsRawFd, FromRawFd};
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_passed_fd_reaches_the_same_file() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"arena").unwrap();
        let n = send_fd(a.as_raw_fd(), b"hi", f.as_raw_fd()).unwrap();
        assert_eq!(n, 2);
        // Receive with a plain recvmsg.
        let mut buf = [0u8; 2];
        let mut control = [0u8; 64];
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: 2,
        };
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr() as *mut libc::c_void;
        msg.msg_controllen = control.len() as _;
        // SAFETY: buffers outlive the call; the cmsg is read only when present.
        let got = unsafe {
            let n = libc::recvmsg(b.as_raw_fd(), &mut msg, 0);
            assert_eq!(n, 2);
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            assert!(!cmsg.is_null());
            std::ptr::read_unaligned(libc::CMSG_DATA(cmsg) as *const RawFd)
        };
        assert_eq!(&buf, b"hi");
        // SAFETY: the kernel installed a new fd for us; we own it now.
        let mut g = unsafe { std::fs::File::from_raw_fd(got) };
        g.rewind().unwrap();
        let mut s = String::new();
        g.read_to_string(&mut s).unwrap();
        assert_eq!(s, "arena");
    }
}
