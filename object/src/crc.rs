//! Per-block CRCs in each algorithm an object store may publish for a whole object, so that
//! an object's CRC is its blocks' combined without reading them again (the origin check of
//! blocks from rack peers, where no MD5 ETag exists).

/// A whole object's CRC, as the store computed it at upload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FullCrc {
    /// CRC-64/NVME (S3's default since 2025).
    Crc64Nvme(u64),
    /// CRC-32C (Castagnoli): S3, and every GCS object.
    Crc32c(u32),
    /// CRC-32 (ISO-HDLC, as zlib's): S3.
    Crc32(u32),
}

impl FullCrc {
    /// The algorithm's name, as S3 spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Crc64Nvme(_) => "CRC64NVME",
            Self::Crc32c(_) => "CRC32C",
            Self::Crc32(_) => "CRC32",
        }
    }

    /// The crc-fast algorithm and the expected value.
    pub fn algorithm(self) -> (crc_fast::CrcAlgorithm, u64) {
        match self {
            Self::Crc64Nvme(crc) => (crc_fast::CrcAlgorithm::Crc64Nvme, crc),
            Self::Crc32c(crc) => (crc_fast::CrcAlgorithm::Crc32Iscsi, u64::from(crc)),
            Self::Crc32(crc) => (crc_fast::CrcAlgorithm::Crc32IsoHdlc, u64::from(crc)),
        }
    }
}

/// A block's CRC in each algorithm a store may publish, kept as the block arrives, so that an
/// object's CRC is its blocks' combined (`crc_fast::checksum_combine`) without reading them
/// again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCrcs {
    crc64nvme: u64,
    crc32c: u32,
    crc32: u32,
}

impl BlockCrcs {
    /// The CRCs of `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self {
            crc64nvme: crc_fast::checksum(crc_fast::CrcAlgorithm::Crc64Nvme, bytes),
            crc32c: crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, bytes) as u32,
            crc32: crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32IsoHdlc, bytes) as u32,
        }
    }

    /// The CRC in the algorithm of `crc`.
    pub fn get(&self, crc: FullCrc) -> u64 {
        match crc {
            FullCrc::Crc64Nvme(_) => self.crc64nvme,
            FullCrc::Crc32c(_) => u64::from(self.crc32c),
            FullCrc::Crc32(_) => u64::from(self.crc32),
        }
    }
}
