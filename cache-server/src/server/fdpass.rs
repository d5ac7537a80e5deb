//! Passing the DRAM arena's and the staging region's file descriptors to a local client
//! (SCM_RIGHTS).

use std::os::fd::RawFd;

/// Most descriptors one message carries.
const MAX_FDS: usize = 4;

/// Sends `bytes` on the Unix stream socket `sock` with `fds` attached (one SCM_RIGHTS
/// message, in order). Non-blocking: returns `WouldBlock` when the socket is full. Returns
/// the bytes sent (the fds ride with them).
///
/// # Panics
/// If `fds` is empty or holds more than 4.
pub(crate) fn send_fds(sock: RawFd, bytes: &[u8], fds: &[RawFd]) -> std::io::Result<usize> {
    assert!(!fds.is_empty() && fds.len() <= MAX_FDS, "1..=4 fds");
    let fd_bytes = std::mem::size_of_val(fds) as u32;
    // SAFETY: CMSG_SPACE is a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(fd_bytes) } as usize;
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
    // SAFETY: msg_control points at `space` bytes, enough for one cmsg holding `fds`, so
    // CMSG_FIRSTHDR is non-null and CMSG_DATA has room for every fd. `iov` borrows `bytes`,
    // which the kernel only reads. Both outlive the sendmsg call.
    let n = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(fd_bytes) as _;
        let data = libc::CMSG_DATA(cmsg) as *mut RawFd;
        for (i, fd) in fds.iter().enumerate() {
            std::ptr::write_unaligned(data.add(i), *fd);
        }
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
    fn passed_fds_reach_the_same_files_in_order() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(b"arena").unwrap();
        let mut f2 = tempfile::tempfile().unwrap();
        f2.write_all(b"staging").unwrap();
        let n = send_fds(a.as_raw_fd(), b"hi", &[f.as_raw_fd(), f2.as_raw_fd()]).unwrap();
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
            assert_eq!((*cmsg).cmsg_len, libc::CMSG_LEN(8) as usize);
            let data = libc::CMSG_DATA(cmsg) as *const RawFd;
            [
                std::ptr::read_unaligned(data),
                std::ptr::read_unaligned(data.add(1)),
            ]
        };
        assert_eq!(&buf, b"hi");
        for (fd, want) in got.into_iter().zip(["arena", "staging"]) {
            // SAFETY: the kernel installed a new fd for us; we own it now.
            let mut g = unsafe { std::fs::File::from_raw_fd(fd) };
            g.rewind().unwrap();
            let mut s = String::new();
            g.read_to_string(&mut s).unwrap();
            assert_eq!(s, want);
        }
    }
}
